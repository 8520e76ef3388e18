"""A model of the relay's lease protocol for the Spin model checker (model/README.md):
`python -m model` checks it exhaustively within its bounds, `--mutants` checks that each
deliberately broken variant of it is caught."""
