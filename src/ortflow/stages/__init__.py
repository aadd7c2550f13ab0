"""The stage commands, one module a Snakemake rule (`ortflow <command>`, cli.py): each
reads as its stage's steps and imports the libraries beside this package, never
another stage (tests/test_imports.py)."""
