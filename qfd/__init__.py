"""qfd: quantize the target, quantize the drafter.

An INT4 target recovered by quantization-aware distillation on its original grid, a DFlash
block-diffusion drafter (trained in two stages, GPTQ-quantized, sliding-window attention),
served with lossless speculative decoding. Nothing heavy is imported here so that
`qfd --help` stays instant.
"""

__version__ = "0.1.0"
