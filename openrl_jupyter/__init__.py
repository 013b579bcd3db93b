"""openrl_jupyter: the notebook side of openrl (magics, widgets, background RL runs).

It stays light: it imports without torch. Its features arrive with the notebook milestone; today
the service (`openrl_service`) and the Tinker SDK are the way in.
"""

__version__ = "0.1.0"
