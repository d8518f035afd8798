// STREAM's triad as a standalone OpenMP program: the host's attainable memory bandwidth that
// docs/PERFORMANCE.md rule 8 sets a CPU update against (slidedp/plan/triad.py builds and runs it).
//
//   cc -O3 -march=native -fopenmp stream_triad.c -o stream_triad
//   export OMP_NUM_THREADS=16 OMP_PROC_BIND=close OMP_PLACES=cores
//   ./stream_triad ELEMENTS [REPEATS=10] [plain|nt] [static|dynamic] [triad|swap]
//
// a[i] = b[i] + s * c[i] over three FP64 arrays of ELEMENTS each, STREAM's rules: the arrays are
// first touched by the threads that later use them (a static schedule, the triad's own unless
// `dynamic`), one untimed run warms up, each of REPEATS runs is timed on its own, and the bytes
// are counted as STREAM counts them, 24 per element (b and c read, a written; the write-allocate
// read of a is not counted). `nt` writes a with non-temporal stores, which skip that read.
// `dynamic` hands the timed loop out in chunks of 32 Ki elements, as our CPU Adam's pool does: on
// a VM whose vCPUs run unevenly a static split waits for the slowest one. Prints one JSON line.
//
// `swap` exchanges a and b in place instead (plain stores only), 32 bytes per element: as many
// bytes written as read, each written line the one just read, which is the CPU AdamW's traffic
// (master and moments updated in place): the same mix, without its arithmetic.

#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define ALIGN (2u << 20)   // huge-page aligned, so each array can be backed by 2 MiB pages
#define BLOCK 8            // elements per scheduled unit: one 64-byte line, whole vectors
#define TRIAD_BYTES 24     // STREAM's count for the triad
#define SWAP_BYTES 32      // a and b each read and written
#define SCALAR 3.0
#define DYNAMIC_CHUNK 4096  // blocks: 32 Ki elements, csrc/cpu_adam.cpp's kBlock

#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__) || defined(__clang__)
#define HAVE_NT 1
#else
#define HAVE_NT 0
#endif

static void fail(const char* message) {
  fprintf(stderr, "stream_triad: %s\nusage: stream_triad ELEMENTS [REPEATS=10] [plain|nt] [static|dynamic] [triad|swap]\n",
          message);
  exit(2);
}

static long long parse_positive(const char* text, const char* name) {
  char* end = NULL;
  errno = 0;
  long long value = strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < 1) {
    char message[128];
    snprintf(message, sizeof message, "%s must be a positive integer, got '%s'", name, text);
    fail(message);
  }
  return value;
}

static double* alloc_array(int64_t n) {
  size_t bytes = ((size_t)n * sizeof(double) + ALIGN - 1) / ALIGN * ALIGN;
  void* p = NULL;
  if (posix_memalign(&p, ALIGN, bytes) != 0) fail("out of memory for the arrays");
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint: fewer TLB misses where THP is in madvise mode
#endif
  return (double*)p;
}

// One block of 8 elements with non-temporal stores; a, b, c are 64-byte aligned here.
static inline void triad_block_nt(double* restrict a, const double* restrict b,
                                  const double* restrict c, double s) {
#if defined(__AVX512F__)
  _mm512_stream_pd(a, _mm512_add_pd(_mm512_load_pd(b), _mm512_mul_pd(_mm512_set1_pd(s), _mm512_load_pd(c))));
#elif defined(__AVX__)
  const __m256d vs = _mm256_set1_pd(s);
  for (int k = 0; k < BLOCK; k += 4) {
    _mm256_stream_pd(a + k, _mm256_add_pd(_mm256_load_pd(b + k), _mm256_mul_pd(vs, _mm256_load_pd(c + k))));
  }
#elif defined(__SSE2__)
  const __m128d vs = _mm_set1_pd(s);
  for (int k = 0; k < BLOCK; k += 2) {
    _mm_stream_pd(a + k, _mm_add_pd(_mm_load_pd(b + k), _mm_mul_pd(vs, _mm_load_pd(c + k))));
  }
#elif defined(__clang__)
#pragma omp simd
  for (int k = 0; k < BLOCK; ++k) __builtin_nontemporal_store(b[k] + s * c[k], a + k);
#else
  (void)a, (void)b, (void)c, (void)s;
#endif
}

static void store_fence(void) {
#if defined(__SSE2__)
  _mm_sfence();  // this thread's streaming stores are globally visible before the barrier
#endif
}

// The tail (under one block) is left to the caller: it is at most 7 elements. The schedule is
// the one main sets (omp_set_schedule).
static void triad(double* restrict a, const double* restrict b, const double* restrict c,
                  int64_t blocks, int nt) {
#pragma omp parallel
  {
    if (nt) {
#pragma omp for schedule(runtime) nowait
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t i = blk * BLOCK;
        triad_block_nt(a + i, b + i, c + i, SCALAR);
      }
      store_fence();
    } else {
#pragma omp for schedule(runtime) nowait
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t i = blk * BLOCK;
#pragma omp simd
        for (int k = 0; k < BLOCK; ++k) a[i + k] = b[i + k] + SCALAR * c[i + k];
      }
    }
  }
}

// a and b exchanged in place, the tail included; the schedule is the one main sets.
static void swap(double* restrict a, double* restrict b, int64_t n) {
  const int64_t blocks = n / BLOCK;
#pragma omp parallel for schedule(runtime)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i = blk * BLOCK;
#pragma omp simd
    for (int k = 0; k < BLOCK; ++k) {
      const double t = a[i + k];
      a[i + k] = b[i + k];
      b[i + k] = t;
    }
  }
  for (int64_t i = blocks * BLOCK; i < n; ++i) {
    const double t = a[i];
    a[i] = b[i];
    b[i] = t;
  }
}

static void run_once(double* a, double* b, const double* c, int64_t n, int nt, int swapping) {
  if (swapping) {
    swap(a, b, n);
    return;
  }
  const int64_t blocks = n / BLOCK;
  triad(a, b, c, blocks, nt);
  for (int64_t i = blocks * BLOCK; i < n; ++i) a[i] = b[i] + SCALAR * c[i];
}

static int compare_doubles(const void* x, const void* y) {
  const double u = *(const double*)x, v = *(const double*)y;
  return (u > v) - (u < v);
}

int main(int argc, char** argv) {
  if (argc < 2 || argc > 6) fail("expected 1 to 5 arguments");
  const int64_t n = parse_positive(argv[1], "ELEMENTS");
  const int repeats = argc > 2 ? (int)parse_positive(argv[2], "REPEATS") : 10;
  const char* mode = argc > 3 ? argv[3] : "plain";
  if (strcmp(mode, "plain") != 0 && strcmp(mode, "nt") != 0) fail("mode must be 'plain' or 'nt'");
  const int nt = strcmp(mode, "nt") == 0;
  if (nt && !HAVE_NT) fail("this build has no non-temporal stores for mode 'nt'");
  const char* kernel = argc > 5 ? argv[5] : "triad";
  if (strcmp(kernel, "triad") != 0 && strcmp(kernel, "swap") != 0) fail("kernel must be 'triad' or 'swap'");
  const int swapping = strcmp(kernel, "swap") == 0;
  if (swapping && nt) fail("kernel 'swap' writes the lines it reads: mode must be 'plain'");
  const char* schedule = argc > 4 ? argv[4] : "static";
  if (strcmp(schedule, "static") == 0) {
    omp_set_schedule(omp_sched_static, 0);
  } else if (strcmp(schedule, "dynamic") == 0) {
    omp_set_schedule(omp_sched_dynamic, DYNAMIC_CHUNK);
  } else {
    fail("schedule must be 'static' or 'dynamic'");
  }

  double* a = alloc_array(n);
  double* b = alloc_array(n);
  double* c = alloc_array(n);
  const int64_t blocks = n / BLOCK;
  // First touch with the static schedule: each page lands on the node of the thread using it.
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int64_t i = blk * BLOCK; i < (blk + 1) * BLOCK; ++i) {
      a[i] = 0.0;
      b[i] = 2.0;
      c[i] = 0.5;
    }
  }
  for (int64_t i = blocks * BLOCK; i < n; ++i) a[i] = 0.0, b[i] = 2.0, c[i] = 0.5;

  run_once(a, b, c, n, nt, swapping);  // warm-up: thread team, TLBs
  double* seconds = malloc(sizeof(double) * (size_t)repeats);
  if (seconds == NULL) fail("out of memory");
  for (int r = 0; r < repeats; ++r) {
    const double start = omp_get_wtime();
    run_once(a, b, c, n, nt, swapping);
    seconds[r] = omp_get_wtime() - start;
  }

  int64_t wrong = 0;
  // After the warm-up and REPEATS swaps, a holds b's 2.0 when their count is odd, else its 0.0.
  const double expected = !swapping ? 2.0 + SCALAR * 0.5 : (repeats + 1) % 2 ? 2.0 : 0.0;
#pragma omp parallel for schedule(static) reduction(+ : wrong)
  for (int64_t i = 0; i < n; ++i) wrong += a[i] != expected;
  if (wrong != 0) {
    fprintf(stderr, "stream_triad: %lld of %lld elements differ from %g\n", (long long)wrong, (long long)n,
            expected);
    return 1;
  }

  qsort(seconds, (size_t)repeats, sizeof(double), compare_doubles);
  const double median = repeats % 2 ? seconds[repeats / 2]
                                    : 0.5 * (seconds[repeats / 2 - 1] + seconds[repeats / 2]);
  const double bytes = (double)(swapping ? SWAP_BYTES : TRIAD_BYTES) * (double)n;
  printf("{\"threads\": %d, \"elements\": %lld, \"repeats\": %d, \"mode\": \"%s\", \"schedule\": \"%s\", "
         "\"kernel\": \"%s\", "
         "\"best_s\": %.9g, "
         "\"median_s\": %.9g, \"best_gbs\": %.6g, \"median_gbs\": %.6g}\n",
         omp_get_max_threads(), (long long)n, repeats, mode, schedule, kernel, seconds[0], median,
         bytes / seconds[0] / 1e9, bytes / median / 1e9);
  free(seconds);
  free(a);
  free(b);
  free(c);
  return 0;
}
