"""The rounding math: INT4 packing, GPTQ (+ its Triton kernels), AWQ scales. Tensors in, tensors out; no I/O."""
