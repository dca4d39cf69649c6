"""Input data: the embedded corpus (`corpus`), tokenizers (`tokenizers`) and the grain
pipeline (`pipeline`; its grain stages in `transforms`). Import the submodules directly; nothing
is imported here."""
