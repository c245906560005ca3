"""Accelerators: which device, collective backend and dtypes a rank uses (`device.py`), and the
emulated accelerator that lets CPU-only CI enforce a GPU's rules (`emulated/`).

Nothing here imports the engines, the worker or the control plane: they all import this.
"""
