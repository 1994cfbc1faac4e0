"""The KServe v2 / Open Inference Protocol core, shared by every transport."""
