"""Tensor codecs: the registry by name, a tensor's wire form, quantizers, top-k and error feedback."""
