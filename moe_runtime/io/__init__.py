"""Expert I/O: transfer queue, copy engines (CUDA streams / memcpy), link emulation, I/O threads."""
