"""INT4 quantization: grid math, checkpoint formats, runtime INT4 linears, GPTQ driver."""
