# The two namespace nodes of the test cluster, shared by setup.sh and
# teardown.sh (sourced, not run). Private addresses, used only on the bridge
# that setup.sh creates.
NODES=(node1 node2)
declare -A NODE_ADDR=([node1]=10.77.0.11 [node2]=10.77.0.12)
BRIDGE=ortflow-br
BRIDGE_ADDR=10.77.0.1
TWO_NODE_PARTITION=twonodes

# The network namespace of a node, and the host's end of its veth pair.
netns_of() { echo "ortflow-$1"; }
veth_of() { echo "ortflow-$1"; }
