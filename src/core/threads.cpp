#include <omp.h>

#include "msa/ops.h"

namespace msa {

namespace {
int default_threads() {
  static const int threads = omp_get_num_procs();
  return threads;
}
}  // namespace

void set_num_threads(int threads) {
  MSA_CHECK_ARG(threads >= 0, "threads", "a non-negative count (0 for all cores)", threads);
  omp_set_num_threads(threads == 0 ? default_threads() : threads);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace msa
