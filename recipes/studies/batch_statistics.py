"""`python recipes/studies/batch_statistics.py [options]`: the study `hf_powernorm.studies.batch_statistics` (its docstring
says what it runs and writes; also `python -m hf_powernorm.studies batch_statistics`)."""

from hf_powernorm.studies.batch_statistics import main

if __name__ == "__main__":
    main()
