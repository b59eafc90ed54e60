"""`python -m colo` is `python -m colo.launch`."""
import sys

from colo.launch import main

sys.exit(main())
