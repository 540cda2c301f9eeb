"""Below everything: moving tensors between the host and the device, and the process heap."""
