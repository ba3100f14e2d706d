"""glibc's malloc settings for the Ray workers raypipe starts: large CPU tensors reused, not page-faulted in anew.

glibc serves each allocation above its mmap threshold (128 KiB, rising to at
most 32 MiB as such blocks are freed) with a fresh mapping and unmaps it on
free, and gives the heap's top back to the kernel above 128 KiB. A step on CPU
allocates and frees its logits, activations and gradients (tens to hundreds of
MB each) every time, so the kernel zero-filled each of them again: a
debug_cpu-sized drafter step spent half its time in the kernel and ran 2.2x
slower, and an engine's work took 1.2x the CPU (bench/cpu_heap.py). With both
thresholds out of reach the heap keeps freed blocks for the next step; the
step's peak memory rose 2%. glibc reads these variables when a process starts, so they go
into the runtime env of each worker (trainers, service replicas, reply writers,
evaluation engines: raypipe.serve.vllm_args.ENGINE_ENV).
"""

HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
