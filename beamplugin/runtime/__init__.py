"""Below everything: moving tensors between the host and the device, the process heap and
the garbage collector."""
