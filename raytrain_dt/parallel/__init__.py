"""Model-parallel plans (tensor parallel) for the models in `raytrain_dt.models`."""
