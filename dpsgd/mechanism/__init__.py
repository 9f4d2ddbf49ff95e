"""The DP mechanism of Algorithm 1: the sampler (q), per-example clipping, Gaussian noise, the
DP-SGD step, DP-PCA, EMA."""
