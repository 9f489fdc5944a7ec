"""A custom ("remote code") transformers model, saved with save_pretrained and loaded with trust_remote_code=True.

Written by us on purpose: the point is the loading path (auto_map, code copied next to the weights, the class
imported from the HF modules cache in every process), which real hub models with custom code go through.
See tests/corpus.py: save_remote_model / load_remote_model.
"""
