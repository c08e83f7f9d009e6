"""The study `hf_powernorm.studies.batch_size` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies batch_size`)."""

from hf_powernorm.studies.batch_size import main

if __name__ == "__main__":
    main()
