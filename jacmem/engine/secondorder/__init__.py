"""The second-order engine: the module chain, the autograd path, and the façade over both."""
