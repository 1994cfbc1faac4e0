"""The firmware build stage: a spec in, a signed bundle out (bundle.py), with the engines' build-time
work (TensorRT plans, the CUDA kernels' weights laid out by the NumPy reference, kernels.py). It sits
above the engines it uses; the daemon never imports it."""
