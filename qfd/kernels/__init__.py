"""GPU kernels (optional: Triton). `qfd.kernels.int4_triton.available()` says whether they run here."""
