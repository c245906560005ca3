"""Worker plane: runs inside rank actors. No Ray control calls in the train step."""
