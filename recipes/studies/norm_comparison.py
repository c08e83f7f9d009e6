"""The study `hf_powernorm.studies.norm_comparison` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies norm_comparison`)."""

from hf_powernorm.studies.norm_comparison import main

if __name__ == "__main__":
    main()
