// webserver stands in for the nginx and httpd images critest uses: it serves HTTP 200 on
// LISTEN_PORT (default 80). As nginx (the default) it re-executes itself so that its command
// line reads like nginx's master process and writes /var/run/nginx.pid; with FLAVOR=httpd it
// logs the line critest looks for in an httpd container's log.
package main

import (
	"fmt"
	"net/http"
	"os"
	"syscall"
)

const nginxArgv0 = "nginx: master process nginx -g daemon off;"

func main() {
	flavor := os.Getenv("FLAVOR")
	if flavor != "httpd" && os.Args[0] != nginxArgv0 {
		exe, err := os.Executable()
		if err == nil {
			err = syscall.Exec(exe, []string{nginxArgv0}, os.Environ())
		}
		fmt.Fprintln(os.Stderr, "re-exec:", err)
		os.Exit(1)
	}
	if flavor == "httpd" {
		fmt.Println("AH00094: Command line: 'httpd -D FOREGROUND'")
	} else {
		_ = os.MkdirAll("/var/run", 0o755)
		_ = os.WriteFile("/var/run/nginx.pid", []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644)
	}
	port := os.Getenv("LISTEN_PORT")
	if port == "" {
		port = "80"
	}
	body, err := os.ReadFile("/usr/share/nginx/html/index.html")
	if err != nil {
		body = []byte("<html><body>It works!</body></html>\n")
	}
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(body)
	})
	if err := http.ListenAndServe(":"+port, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
