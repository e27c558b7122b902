# Sourced by the scripts that run PyTorch peers. glibc hands freed blocks of 128 KiB and more
# back to the kernel, so each step's new gradients and optimizer temporaries (16.8 MB tensors
# for the trainer's MLP) fault their pages in again: on some days' machines that made torch's
# step 2-3x slower and erratic. gradsync-train pools its buffers; the peer keeps freed memory in
# its heap likewise (32 MiB is the largest threshold glibc takes).
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296
