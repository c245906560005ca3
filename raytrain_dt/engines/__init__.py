"""Training engines (FSDP2, DeepSpeed) behind the small protocol in `engines.base`."""
