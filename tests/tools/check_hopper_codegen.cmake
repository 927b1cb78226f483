# Compiles the PTX of an sm_90 decode kernel (the Hopper decode kernel, the combine kernel) with
# ptxas (no GPU needed) and fails when the code that ptxas generates has lost what the kernel's
# speed rests on:
#   - wgmma serialised: ptxas notes C7510 / C7515 / C7520 ("wgmma.mma_async instructions are
#     serialized"), emitted when, for example, the warps of a consumer warpgroup take different
#     paths around a loop between two wgmma groups (C7520), or a non-wgmma instruction defines an
#     accumulator register inside a pipeline stage (C7515). Every wgmma then waits for the one
#     before it; the kernel still computes the right answer, 30-40 % slower.
#   - register spills: the Hopper kernel's register budget (setmaxnreg: producer 40, consumers
#     232, of the 168 x 384 the CTA has) is exact, and the combine kernel's (128 a thread at two
#     CTAs an SM) nearly full; a spill means a change outgrew it.
#   - code size (with -DMAX_TEXT_BYTES and -DREADELF): each kernel's machine code (its .text
#     section in the cubin) at most MAX_TEXT_BYTES. The Hopper kernel's two consumer loops are
#     ~19-21 KB each and run from the instruction cache every pair: 9 KB more code (a second copy of
#     the producer) made it 4-5 % slower with nothing else changed, and ncu's "no instruction"
#     stalls grew by 40 % (docs/perf-notes.md, eleventh session). The combine kernel runs once a
#     call from a cold instruction cache. Raise a budget only with a measurement that says the
#     extra code pays. A kernel whose name matches -DWIDE_BUDGET_MATCH (a regex) takes
#     -DWIDE_BUDGET_BYTES instead (the Hopper kernel's fp8 instance for 64-row tiles: its extra
#     code converts the query once an item, off the loops that run every pair).
# Inputs: -DPTXAS=<ptxas> -DPTX=<file.ptx> -DARCH=sm_90a -DOUT=<scratch cubin>
#         [-DREADELF=<readelf> -DMAX_TEXT_BYTES=<n> [-DWIDE_BUDGET_MATCH=<regex> -DWIDE_BUDGET_BYTES=<n>]]
foreach(var PTXAS PTX ARCH OUT)
  if(NOT ${var})
    message(FATAL_ERROR "check_hopper_codegen: -D${var}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${PTX}")
  message(FATAL_ERROR "check_hopper_codegen: no PTX at ${PTX} (build the target mla_hopper_ptx first)")
endif()
execute_process(COMMAND ${PTXAS} -arch=${ARCH} -O3 -v --generate-line-info ${PTX} -o ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(APPEND out "${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ptxas failed (${rc}):\n${out}")
endif()

# Every entry point that ptxas compiled, with its register and spill lines.
string(REGEX MATCHALL "Compiling entry function '[^']+'" entries "${out}")
list(LENGTH entries n_entries)
if(n_entries EQUAL 0)
  message(FATAL_ERROR "ptxas compiled no entry function from ${PTX}:\n${out}")
endif()
set(problems "")
string(REGEX MATCHALL "[^\n]*(C7510|C7515|C7520|instructions are serialized)[^\n]*" serial "${out}")
foreach(line IN LISTS serial)
  string(APPEND problems "  wgmma serialised: ${line}\n")
endforeach()
# One spill line per compiled function (entry points, and any device function kept out of line).
string(REGEX MATCHALL "[0-9]+ bytes spill stores, [0-9]+ bytes spill loads" spills "${out}")
list(LENGTH spills n_spills)
if(n_spills LESS n_entries)
  message(FATAL_ERROR "expected a spill line for each of the ${n_entries} entry functions, found ${n_spills}:\n${out}")
endif()
foreach(line IN LISTS spills)
  if(NOT line MATCHES "^0 bytes spill stores, 0 bytes spill loads")
    string(APPEND problems "  register spills: ${line}\n")
  endif()
endforeach()
string(REGEX MATCHALL "Used [0-9]+ registers" regs "${out}")
message(STATUS "${n_entries} entry functions; ${regs}; ${spills}")
if(MAX_TEXT_BYTES)
  if(NOT READELF)
    message(FATAL_ERROR "check_hopper_codegen: -DMAX_TEXT_BYTES needs -DREADELF=<readelf>")
  endif()
  execute_process(COMMAND ${READELF} -S -W ${OUT} RESULT_VARIABLE rc OUTPUT_VARIABLE sections
                  ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "readelf -S failed (${rc}) on ${OUT}")
  endif()
  # "[Nr] Name Type Address Off Size ...": the .text section of each kernel.
  string(REGEX MATCHALL "\\.text\\.[^ ]+ +PROGBITS +[0-9a-f]+ +[0-9a-f]+ +[0-9a-f]+" texts "${sections}")
  list(LENGTH texts n_texts)
  if(n_texts LESS n_entries)
    message(FATAL_ERROR "expected a .text section for each of the ${n_entries} entry functions in ${OUT}, "
                        "found ${n_texts}:\n${sections}")
  endif()
  foreach(t IN LISTS texts)
    string(REGEX REPLACE "^\\.text\\.([^ ]+) .* ([0-9a-f]+)$" "\\1;\\2" name_size "${t}")
    list(GET name_size 0 name)
    list(GET name_size 1 hex)
    math(EXPR bytes "0x${hex}")
    set(budget ${MAX_TEXT_BYTES})
    if(WIDE_BUDGET_MATCH AND name MATCHES "${WIDE_BUDGET_MATCH}")
      set(budget ${WIDE_BUDGET_BYTES})
    endif()
    message(STATUS "${bytes} bytes of code (budget ${budget}): ${name}")
    if(bytes GREATER budget)
      string(APPEND problems "  code size: ${bytes} bytes, more than the budget of ${budget}: ${name}\n")
    endif()
  endforeach()
endif()
if(problems)
  message(FATAL_ERROR "code generation of ${PTX} (${ARCH}):\n${problems}")
endif()
