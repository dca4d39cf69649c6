"""Input data: the embedded corpus (`corpus`), tokenizers (`tokenizers`) and the grain
pipeline (`pipeline`). Import the submodules directly; nothing is imported here."""
