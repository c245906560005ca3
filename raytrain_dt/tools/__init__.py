"""Offline tools above the engines: they drive an engine in this process, without Ray (the
FSDP2 <-> DeepSpeed checkpoint converter, `checkpoint_convert`)."""
