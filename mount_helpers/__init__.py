"""The mount(8) helper, the systemd user unit and the bash completion, installed with the
package as data (``olliefs._helpers``) for ``ollie install-helpers`` to copy into place.

A package only so that they travel with every install, wheel or editable; see ollie(1).
"""
