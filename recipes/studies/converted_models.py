"""The study `hf_powernorm.studies.converted_models` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies converted_models`)."""

from hf_powernorm.studies.converted_models import main

if __name__ == "__main__":
    main()
