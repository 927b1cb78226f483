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
# Inputs: -DPTXAS=<ptxas> -DPTX=<file.ptx> -DARCH=sm_90a -DOUT=<scratch cubin>
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
if(problems)
  message(FATAL_ERROR "code generation of ${PTX} (${ARCH}):\n${problems}")
endif()
