"""GGUF files read in place: their header (:mod:`.file`), block dequantization in torch (:mod:`.dequant`) and the store
that dequantizes offloaded tensors on every read (:mod:`.store`)."""
