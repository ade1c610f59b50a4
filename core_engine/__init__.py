"""infermux's native inference engine. Imports nothing from gateway/, plugins/ or backends/.

Heavy modules (torch) are imported lazily so that light helpers such as
:mod:`core_engine.chat.template` can be used without loading torch.
"""
