"""What a person sees of a run: the plots and tables of `snakemake --report`
(plots.py, tables.py, from the results as results.py reads and shows them), the lines
printed when `snakemake` finishes (summary.py), and a failed stage's error (failures.py)."""
