"""The forward pass (`transformer`) and a model opened for compute (`loader`): above the
backends that run it, below the engines that drive it."""
