"""This CPU's bfloat16 arithmetic peak: a loop of independent AVX512-BF16 dot products
(`vdpbf16ps`, 12 accumulators, no memory), one process a core, compiled here with gcc. What the
prefill's linears and attention are compared against (perf/RESULTS.md, "Prefix cache").

    .venv/bin/python perf/experiments/bf16_peak.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
from cli import cpu_model

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a;
  const long n = 200000000 / 12;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    __asm__ volatile("" : "+v"(a));  /* (the loop is not folded away) */
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  float r = 0;
  for (int i = 0; i < 12; i++) r += _mm512_reduce_add_ps(acc[i]);
  printf("%.1f %g\n", n * 12 * 64.0 / s / 1e9, r);  /* 32 pairs a vector: 64 FLOP */
  return 0;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        source, binary = os.path.join(folder, "peak.c"), os.path.join(folder, "peak")
        with open(source, "w") as f:
            f.write(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512bf16", source, "-o", binary], check=True)
        cores = os.cpu_count() or 1
        alone = float(subprocess.run([binary], capture_output=True, text=True, check=True).stdout.split()[0])
        runs = [subprocess.Popen([binary], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
        together = [float(run.communicate()[0].split()[0]) for run in runs]
    print(f"CPU: {cpu_model()}; bfloat16 dot products: {alone:.0f} GFLOP/s on one core alone; "
          f"{sum(together):.0f} on all {cores} at once ({', '.join(f'{g:.0f}' for g in together)})")


if __name__ == "__main__":
    main()
