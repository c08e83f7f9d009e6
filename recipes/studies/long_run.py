"""The study `hf_powernorm.studies.long_run` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies long_run`)."""

from hf_powernorm.studies.long_run import main

if __name__ == "__main__":
    main()
