"""Model-independent training pieces: optimisers and the WSD schedule (`optim`), mesh and
logical-axis sharding (`sharding`), orbax checkpoints (`checkpoint`). Import the submodules
directly; nothing is imported here."""
