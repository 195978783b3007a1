"""``python -m lit_smd`` is the ``lit-smd`` command."""

from lit_smd.cli import main

if __name__ == "__main__":
    main()
