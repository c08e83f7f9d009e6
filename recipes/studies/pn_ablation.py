"""`python recipes/studies/pn_ablation.py [options]`: the study `hf_powernorm.studies.pn_ablation` (its docstring
says what it runs and writes; also `python -m hf_powernorm.studies pn_ablation`)."""

from hf_powernorm.studies.pn_ablation import main

if __name__ == "__main__":
    main()
