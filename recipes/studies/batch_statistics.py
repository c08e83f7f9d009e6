"""The study `hf_powernorm.studies.batch_statistics` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies batch_statistics`)."""

from hf_powernorm.studies.batch_statistics import main

if __name__ == "__main__":
    main()
