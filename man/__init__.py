"""The man pages, installed with the package as data (``olliefs._man``).

A package only so that the pages travel with every install, wheel or editable, and
``ollie man`` and ``ollie install-helpers`` find them with ``importlib``; see ollie(1).
"""
