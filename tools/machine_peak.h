// Measured ceilings of this CPU, the denominators of "fraction of peak" in msa bench.
#pragma once

namespace msa::cli {

struct MachinePeak {
  double gflops;           // f32 fused multiply-add rate over all threads (8-lane vectors)
  double read_gb_per_s;    // streaming read bandwidth over all threads
};

MachinePeak measure_machine_peak();

}  // namespace msa::cli
