"""Importing this package registers every check of the catalogue."""

from . import aliases  # noqa: F401
from . import config  # noqa: F401
from . import distributed  # noqa: F401
from . import lifecycle  # noqa: F401
from . import misuse  # noqa: F401
from . import observable  # noqa: F401
from . import plan  # noqa: F401
from . import residency  # noqa: F401
from . import split  # noqa: F401
from . import streams  # noqa: F401
from . import threads  # noqa: F401
