"""`python recipes/studies/tuned_comparison.py [options]`: the study `hf_powernorm.studies.tuned_comparison` (its docstring
says what it runs and writes; also `python -m hf_powernorm.studies tuned_comparison`)."""

from hf_powernorm.studies.tuned_comparison import main

if __name__ == "__main__":
    main()
