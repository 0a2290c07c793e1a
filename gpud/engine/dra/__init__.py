"""gpud as the node's DRA driver (`gpud --kube-node NODE --dra`): gpud.engine.dra.driver."""
