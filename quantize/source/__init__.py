"""Reading a checkpoint: headers, validation, Hub sources, tensor roles, FP8 dequantization, pinned staging."""
