// nnp stands in for critest's nonewprivs image: installed setuid root, it prints the effective
// uid it runs with, which is 0 unless no_new_privs stopped the setuid bit.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Printf("Effective uid: %d\n", os.Geteuid())
}
