"""Data: datasets as tensors (md5-checked), augmentation, ScatterNet features.
`python -m dpsgd.data` seeds the data root."""
