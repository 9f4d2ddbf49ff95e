"""Layer rules of the ghost engine beyond ``layers.py``, registered by module type on import:
convolutions (``conv.py``) and attention (``attention.py``)."""

from . import attention, conv  # noqa: F401
