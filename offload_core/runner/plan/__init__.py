"""The plan made before anything is loaded: the model, its batches and their memory, the device map and reservation,
the predicted times and the printed report."""
